"""Loss scaling: the LossScaler protocol, the dynamic, static and adaptive scalers, their inf checks."""
