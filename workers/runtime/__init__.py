"""The subagent runtime: agent loop, model providers, offline model, usage and cost."""

__all__: list[str] = []
