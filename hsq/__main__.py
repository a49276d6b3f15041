from hsq.cli import main

main()
