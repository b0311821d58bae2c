"""Adapters to other projects' standards: trainers (``trl``) that consume atroposlib
environments. Each module needs its own extra (``pip install "atroposlib[trl]"``)."""
