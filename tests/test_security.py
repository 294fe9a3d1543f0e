"""Security policy, checked on the source: nothing a user received is unpickled, and no user
string reaches a shell (subprocesses get argument lists)."""

import re
from pathlib import Path

SOURCE = sorted((Path(__file__).parent.parent / "src" / "isoloco").rglob("*.py"))
FORBIDDEN = {
    "unpickling": re.compile(r"\bpickle\b|\btorch\.load\(|\bnp\.load\(.*allow_pickle=True"),
    "a shell": re.compile(r"shell\s*=\s*True|\bos\.system\(|\bos\.popen\("),
}


def test_the_policy_is_checked_on_the_real_source():
    assert len(SOURCE) > 20 and any(p.name == "sweep.py" for p in SOURCE)


def test_no_unpickling_and_no_shell():
    offences = [f"{path.name}:{number}: {what}: {line.strip()}"
                for path in SOURCE
                for number, line in enumerate(path.read_text().splitlines(), 1)
                if not line.lstrip().startswith("#")
                for what, pattern in FORBIDDEN.items() if pattern.search(line)]
    assert offences == []
