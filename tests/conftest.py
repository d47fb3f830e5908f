"""Suite-wide settings."""
import gc


def pytest_collection_finish(session):
    """Everything imported by collection (torch, the repository, every test file) lives until the
    suite ends: frozen, the garbage collector's full passes during the in-process tests (the
    one-process baselines) skip it. Objects the tests make are collected as before."""
    gc.freeze()
