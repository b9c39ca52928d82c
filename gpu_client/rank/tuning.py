"""How a GPU client tunes its ranks' start: the switches are declared in ``zwdx.tuning`` (the CLI
that offers them builds without gpu_client); the rank and the agent read them from here."""
from __future__ import annotations

from zwdx.tuning import DEFAULT_TUNING, VARIABLES, WARMUPS, Tuning

__all__ = ["DEFAULT_TUNING", "VARIABLES", "WARMUPS", "Tuning"]
