"""Launching: probe the nodes over a Transport, diff against the plan, act (docker run, Ray),
`cluster up/down/status/exec`, and the head server that `serve -i` starts."""
