"""jzero.disk: the one write probe of the directories jzero writes to."""

import errno

from jzero.disk import write_probe_error


def test_a_writable_directory_takes_the_probe_and_keeps_nothing(tmp_path):
  assert write_probe_error(tmp_path) is None
  assert list(tmp_path.iterdir()) == []


def test_a_path_that_cannot_take_a_file_gives_the_os_error(tmp_path):
  a_file = tmp_path / "file"
  a_file.write_text("x")
  error = write_probe_error(a_file)
  assert isinstance(error, OSError) and error.errno == errno.ENOTDIR
  assert write_probe_error(tmp_path / "missing").errno == errno.ENOENT
