"""REST routes that only the dashboard uses (history, room overview helpers)."""
from __future__ import annotations

from flask import Blueprint

bp = Blueprint("dashboard_api", __name__)
