"""Prefect tasks and the plain functions behind them."""
