from hsq.app.cli import main

main()
