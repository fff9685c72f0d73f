"""Helper of `make test-vllm` (not a test): print how many tests a JUnit XML report says passed; fail on none, or on
any skipped (a stage whose tests all skip must not pass)."""

import sys
import xml.etree.ElementTree as ET


def main(path: str) -> int:
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, skipped = int(suite.get("tests")), int(suite.get("skipped"))
    failed = int(suite.get("failures")) + int(suite.get("errors"))
    passed = total - skipped - failed
    print(f"{path}: {passed} passed, {skipped} skipped, {failed} failed")
    return 0 if passed > 0 and skipped == 0 and failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
