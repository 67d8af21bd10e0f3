"""megatrain.ir"""
