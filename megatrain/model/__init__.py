"""Model families: shapes, tensor layout, HF config mapping, FLOPs and initialisation (the bottom layer: imports nothing else of megatrain but the settings grammar)."""
