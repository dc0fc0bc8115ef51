"""What the tests share: builders, constants and fixtures, and the stand-ins for services that cannot run here
(tests/README.md lists each module). Test modules import from here, never from another test module or conftest.py;
the fixtures are registered for every test module by ``pytest_plugins`` in tests/conftest.py."""
