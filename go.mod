module github.com/whitesky-cloud/vco-storage

go 1.26.0

require (
	github.com/anatol/luks.go v0.0.0-20250316021219-8cd744c3576f
	golang.org/x/crypto v0.59.0
)

require (
	github.com/anatol/devmapper.go v0.0.0-20230829043248-59ac2b9706ba
	github.com/coreos/go-systemd/v22 v22.7.0
	github.com/dgryski/go-camellia v0.0.0-20191119043421-69a8a13fb23d // indirect
	github.com/godbus/dbus/v5 v5.2.4
	github.com/jzelinskie/whirlpool v0.0.0-20201016144138-0675e54bb004 // indirect
	go.yaml.in/yaml/v3 v3.0.6
	golang.org/x/sys v0.50.0
	google.golang.org/grpc v1.85.0
	google.golang.org/protobuf v1.36.12
)

require (
	golang.org/x/net v0.62.0 // indirect
	golang.org/x/text v0.44.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20260817212433-ac3dfec99bb1 // indirect
)
