"""How weights and optimizer state are kept: the WeightKeeper protocol, FP32 masters, compact weights."""
