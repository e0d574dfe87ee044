"""Write the decoding parameter table (from `settings_refusion.DECODING_SETTINGS`) into README.md.

    python scripts/settings_table.py [README.md]

The table sits between the lines `<!-- decoding-settings:begin -->` and `<!-- decoding-settings:end -->`; a test
fails while the README's copy differs from the table.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from settings_refusion import settings_table

BEGIN, END = "<!-- decoding-settings:begin -->", "<!-- decoding-settings:end -->"


def with_table(text: str) -> str:
    """`text` with the table between its markers replaced by the current one."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"The README needs exactly one {BEGIN} line followed by one {END} line.")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{settings_table()}\n{END}{tail}"


def main() -> None:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "README.md")
    text = path.read_text(encoding="utf-8")
    updated = with_table(text)
    path.write_text(updated, encoding="utf-8")
    print(f"{path}: decoding parameter table {'updated' if updated != text else 'already current'}")


if __name__ == "__main__":
    main()
