"""peftune: hyperparameter search for parameter-efficient fine-tuning of a multitask BERT."""

__version__ = "0.1.0"
