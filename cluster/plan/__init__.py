"""Planning: a model's shape and a GPU inventory in, a TP x PP layout with its memory and KV cache
out (`make_plan`). Pure: no SSH, no torch, so `llmctl plan` is instant."""
