"""megatrain.training"""
