"""atroposlib: environment microservices for RL of language models."""

__version__ = "0.5.0.dev0"
