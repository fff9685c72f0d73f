"""trl-tlt: TLT ("Taming the Long Tail") for Hugging Face TRL."""

__version__ = "0.1.0.dev0"
