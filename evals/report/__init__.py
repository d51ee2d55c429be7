"""What an eval shows: `render` (report.json, report.md, report.png and the terminal table) and `card` (the
accuracy section of an export's model card, through quant's model-card API)."""
