"""Parallel state (ranks, groups, the few collectives the model calls), the shared-memory ring a step
travels by, and the liveness connections of ranks on other nodes. Runs in every rank. Imports only torch
and the top-level leaves.
"""
