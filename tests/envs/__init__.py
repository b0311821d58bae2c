"""Tests of atroposlib.envs."""
