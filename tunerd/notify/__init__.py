"""Alerts into chat ops: the alert model, one small module per service, the dispatcher."""
