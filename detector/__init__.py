"""Face-detection training pipeline and laboratory for losses over dynamically shaped targets."""

__version__ = "0.1.0"
