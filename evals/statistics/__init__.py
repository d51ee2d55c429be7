"""The eval stage's statistics: pure functions, numpy in, numbers out (no torch, no lm-eval, no I/O).

`pairing` aligns the two arms' answers question by question, `accuracy` and `paired_interval` give the paired
difference with its Tango interval and the non-inferiority verdict, `acceptance` the MTP draft's acceptance,
`evidence` what must hold before any verdict."""
