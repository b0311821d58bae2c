"""Tests of atroposlib.envs.server_handling."""

import os

# Before transformers is imported: tokenizers come from local folders, never the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
