"""`python -m quant` and the `quant` command (what `torchrun ... -m quant quantize ...` runs on every rank).

Light on purpose: the supervisor (quant.process.supervise) starts the command's process before the CLI's imports,
so only the child pays for them."""


def main() -> None:
    from quant.process import exit_now, supervise

    supervised = supervise()
    if supervised is not None:
        exit_now(supervised)
    from quant.cli import main as run_cli

    run_cli()


if __name__ == "__main__":
    main()
