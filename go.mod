module github.com/whitesky-cloud/vco-storage

go 1.26.0

require (
	github.com/anatol/luks.go v0.0.0-20250316021219-8cd744c3576f
	golang.org/x/crypto v0.59.0
)

require (
	github.com/anatol/devmapper.go v0.0.0-20230829043248-59ac2b9706ba // indirect
	github.com/dgryski/go-camellia v0.0.0-20191119043421-69a8a13fb23d // indirect
	github.com/jzelinskie/whirlpool v0.0.0-20201016144138-0675e54bb004 // indirect
	golang.org/x/sys v0.50.0 // indirect
)
