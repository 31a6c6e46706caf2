"""The front ends: thin Lightning adapters (Trainer, Fabric) over the numerics core."""
