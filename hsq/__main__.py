from hsq.cli.main import main

main()
