"""The live dashboard: `GET /dashboard` and the JSON it polls (`routes.py`)."""

from pagedkv.server.dashboard.feed import DashboardFeed
from pagedkv.server.dashboard.routes import add_dashboard_routes
from pagedkv.server.dashboard.state import Dashboard, DashboardSources

__all__ = ["Dashboard", "DashboardFeed", "DashboardSources", "add_dashboard_routes"]
