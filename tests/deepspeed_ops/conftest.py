def pytest_configure(config):
    # DeepSpeed's own marker (its CI runs such tests one at a time); here every test runs in-process
    config.addinivalue_line("markers", "sequential: DeepSpeed runs the test alone (no effect here)")
