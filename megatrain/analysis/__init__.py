"""megatrain.analysis"""
