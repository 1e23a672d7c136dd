"""Planning layouts and launching clusters: inventory, model specs, plans, SSH, Docker, Ray.

Pure parts (inventory parsing, the catalog, make_plan, command builders and output parsers) never
import torch, so `llmctl plan` is instant.
"""
