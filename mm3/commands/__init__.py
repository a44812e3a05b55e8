"""The command line: `main` (one subcommand per tool), `jobs` (generate, plan, render), `align`,
`demo` and `playback`; the other tools' subcommands live beside their tools in `mm3.tools`."""
