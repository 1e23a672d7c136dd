"""Clusters: `plan/` (layouts, pure), `launch/` (nodes over SSH, Docker, Ray) and `doctor/` (checks
and the all-reduce test). `inventory.py` (the cluster file) and `errors.py` are shared by all three.

Pure parts (inventory parsing, the catalog, make_plan, command builders and output parsers) never
import torch, so `llmctl plan` is instant.
"""
