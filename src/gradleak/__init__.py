"""gradleak: measure private-data leakage in federated parameter-efficient fine-tuning."""

__version__ = "0.1.0"
