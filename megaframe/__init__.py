"""megaframe: declarative GPT pre-training on DeepSpeed."""

__version__ = "0.1.0"
