"""lm-eval's command line with the `refusion` model registered: `python -m refusion_eval --model refusion ...`."""

from lm_eval.__main__ import cli_evaluate

import refusion_eval  # noqa: F401  (registers the model)


def main() -> None:
    cli_evaluate()


if __name__ == "__main__":
    main()
