"""The discrete-event simulator: predicts the Timeline of a Program from a HardwareProfile."""
