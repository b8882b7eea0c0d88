"""Where a document's figures came from (detector/lab/record/provenance.py): the commit line names the project's own
repository, never another one that holds an unpacked copy of it."""

import os
import re
import shutil
import subprocess

import pytest
from conftest import ROOT

from detector.lab.record import provenance


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_the_commit_line_names_the_projects_own_repository(tmp_path, monkeypatch):
    """Unpacked inside another repository, the project is not a checkout: that repository's commit is not its own."""
    monkeypatch.delenv("DETECTOR_COMMIT", raising=False)
    outer = tmp_path / "outer"
    (outer / "unpacked").mkdir(parents=True)
    (outer / "unpacked" / "README.md").write_text("a copy of the project\n")
    git = ["git", "-C", str(outer), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "another project"]):
        subprocess.run([*git, *args], check=True, capture_output=True)
    head = subprocess.run([*git, "rev-parse", "--short=10", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert provenance.commit(outer) == head
    assert provenance.commit(outer / "unpacked") == "unknown (not a git checkout)"
    assert provenance.commit(tmp_path) == "unknown (not a git checkout)"
    (outer / "unpacked" / "README.md").write_text("changed\n")
    assert provenance.commit(outer) == f"{head} + uncommitted changes"
    monkeypatch.setenv("DETECTOR_COMMIT", "abc1234")
    assert provenance.commit(outer / "unpacked") == "abc1234 (a copy of its tree)"


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="not run from a git checkout")
def test_the_commit_line_of_this_checkout():
    assert (
        re.fullmatch(r"[0-9a-f]{10}( \+ uncommitted changes)?", provenance.commit()) or "DETECTOR_COMMIT" in os.environ
    )
