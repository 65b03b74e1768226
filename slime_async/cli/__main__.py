from slime_async.cli.main import main

main()
