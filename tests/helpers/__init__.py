"""What several test files share: waits, fakes, and a rank set up as the README shows.

Tests import the submodule they need (`from helpers.waiting import wait_until`): this
package sits on `sys.path` through `tests/` (pytest's rootdir conftest, and the scripts
tests spawn put that folder first), as `transport_conformance` does. Nothing is imported
here, so a spawned script that needs only a wait does not load the runtime.
"""
