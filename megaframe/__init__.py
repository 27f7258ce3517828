"""megaframe: declarative GPT pre-training on DeepSpeed."""

__version__ = "0.1.0"


def __getattr__(name: str):
    """megaframe.load_model (megaframe/load.py), imported on first use: `import megaframe` stays free of torch."""
    if name == "load_model":
        from megaframe.load import load_model

        return load_model
    raise AttributeError(f"module 'megaframe' has no attribute {name!r}")
