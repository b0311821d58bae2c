"""Tests of atroposlib.envs.server_handling."""
