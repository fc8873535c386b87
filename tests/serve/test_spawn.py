"""``workbench.serve.spawn``: a server that cannot start says why, in one error, with its own last lines."""

from __future__ import annotations

import pytest

from workbench.errors import WorkbenchError
from workbench.serve.spawn import start_server


def test_a_server_that_ends_before_it_serves_is_an_error_with_its_last_lines():
    with pytest.raises(WorkbenchError) as e:
        start_server(["--port", "0", "--max-num-seqs", "0"], timeout_s=60)
    msg = str(e.value)
    assert "ended with status 2 before it served" in msg and "max_num_seqs=0" in msg, msg
