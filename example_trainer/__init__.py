"""Example GRPO trainer for atroposlib."""
