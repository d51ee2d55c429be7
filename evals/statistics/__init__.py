"""The eval stage's statistics: pure functions, numpy in, numbers out (no torch, no lm-eval, no I/O).

`pairing` aligns the two arms' answers question by question, `accuracy` and `paired_interval` give the paired
difference with its Tango interval and the non-inferiority verdict, `acceptance` the MTP draft's acceptance,
`evidence` what must hold before any verdict; `verdict` the verdict's type, `results` the report's rows and the
report as the program holds them (their JSON form is made where report.json is written)."""
