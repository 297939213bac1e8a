"""engine.atomic: a reader sees the old file or the whole new one; a failed or hijacked write
leaves the old file and no temp behind."""
import os

import pytest

from engine.atomic import atomic_open, atomic_path, atomic_write


def test_write_replaces_whole_and_leaves_no_temp(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"old")
    atomic_write(p, [b"new ", b"data"], durable=True)
    assert p.read_bytes() == b"new data" and os.listdir(tmp_path) == ["f"]
    assert (os.stat(p).st_mode & 0o777) == 0o600


def test_an_error_keeps_the_old_file(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_open(p) as f:
            f.write(b"partial")
            raise RuntimeError("boom")
    assert p.read_bytes() == b"old" and os.listdir(tmp_path) == ["f"]


@pytest.mark.parametrize("how", ["open", "path"])
def test_a_temp_name_swapped_mid_write_is_refused(tmp_path, how):
    """Someone replaces the temp name (e.g. with a symlink to a file of theirs) between create and
    rename: the rename is refused, the target keeps its old bytes, the planted file is untouched."""
    p, planted = tmp_path / "f", tmp_path / "planted"
    p.write_bytes(b"old")
    planted.write_bytes(b"theirs")
    cm = atomic_open(p) if how == "open" else atomic_path(p)
    with pytest.raises(OSError, match="replaced"):
        with cm as x:
            tmp = str(tmp_path / next(n for n in os.listdir(tmp_path) if n.startswith("f.tmp.")))
            os.unlink(tmp)
            os.symlink(planted, tmp)
            if how == "open":
                x.write(b"mine")          # goes to the unlinked file this process created
    assert p.read_bytes() == b"old" and planted.read_bytes() == b"theirs"
