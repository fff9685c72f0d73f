"""`make test-vllm`'s check (tests/_count_passed.py): a stage whose tests all skip, or that runs none, fails."""

import pytest
from _count_passed import main


@pytest.mark.parametrize(
    "tests, skipped, failures, ok", [(14, 0, 0, True), (14, 14, 0, False), (0, 0, 0, False), (14, 0, 1, False)]
)
def test_the_vllm_stage_needs_tests_that_ran_and_passed(tmp_path, capsys, tests, skipped, failures, ok):
    report = tmp_path / "tests.xml"
    report.write_text(
        f'<testsuites><testsuite name="pytest" tests="{tests}" skipped="{skipped}" failures="{failures}" errors="0">'
        "</testsuite></testsuites>"
    )
    assert (main(str(report)) == 0) is ok
    assert f"{tests - skipped - failures} passed" in capsys.readouterr().out
