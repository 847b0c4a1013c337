"""Proposers: where candidate schedules come from (heuristic, evolve, llm)."""
