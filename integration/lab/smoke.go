package lab

import (
	"context"
	"fmt"
	"io"
	"strings"
)

// Smoke is the lab's own check, run by `vco-lab run`: every guest sees the
// shared LUN with the same serial and WWID, and persistent reservations
// made with sg_persist in one guest are seen and enforced in the others
// (the target, not the guest, refuses the write). It leaves the LUN
// without keys.
func Smoke(ctx context.Context, l *Lab, lun *LUN, w io.Writer) error {
	if len(l.Guests) < 2 {
		return fmt.Errorf("smoke scenario needs two guests, the lab has %d", len(l.Guests))
	}
	step := func(format string, a ...any) { fmt.Fprintf(w, "* "+format+"\n", a...) }
	devs, err := smokeSameLUN(ctx, l, lun, step)
	if err != nil {
		return err
	}
	a, b := l.Guests[0], l.Guests[1]
	da, db := devs[a.Name], devs[b.Name]

	if err := smokeReserve(ctx, a, b, da, db, step); err != nil {
		return err
	}
	if err := smokeWrites(ctx, a, b, da, db, step); err != nil {
		return err
	}
	return smokeRelease(ctx, a, b, da, db, step)
}

// smokeKey is the key the first guest registers.
const smokeKey = "0x5643000000000a01"

// smokeSameLUN checks that every guest sees lun with the same WWID and
// returns each guest's device.
func smokeSameLUN(ctx context.Context, l *Lab, lun *LUN, step func(string, ...any)) (map[string]string, error) {
	devs := map[string]string{}
	var wwid string
	for _, g := range l.Guests {
		d, err := g.DiskBySerial(ctx, lun.Serial)
		if err != nil {
			return nil, err
		}
		step("%s sees LUN %s as /dev/%s (sg %s), serial %q, wwid %q", g.Name, lun.IQN, d.Name, d.SG, d.Serial, d.WWID)
		if d.WWID == "" {
			return nil, fmt.Errorf("%s: /dev/%s has no WWID", g.Name, d.Name)
		}
		if wwid == "" {
			wwid = d.WWID
		} else if d.WWID != wwid {
			return nil, fmt.Errorf("%s sees WWID %q, the first guest %q: not the same LUN", g.Name, d.WWID, wwid)
		}
		devs[g.Name] = "/dev/" + d.Name
	}
	return devs, nil
}

// smokeReserve has a register and reserve Write Exclusive on da; b must
// see the key and the reservation on db.
func smokeReserve(ctx context.Context, a, b *Guest, da, db string, step func(string, ...any)) error {
	const keyA = smokeKey
	if _, err := a.MustSh(ctx, "sg_persist -n -o -G -S "+keyA+" "+da); err != nil {
		return err
	}
	step("%s registered key %s", a.Name, keyA)
	out, err := b.MustSh(ctx, "sg_persist -n -i -k "+db)
	if err != nil {
		return err
	}
	if !strings.Contains(out, strings.TrimPrefix(keyA, "0x")) {
		return fmt.Errorf("%s: READ KEYS does not list %s registered by %s:\n%s", b.Name, keyA, a.Name, out)
	}
	step("%s READ KEYS lists %s's key", b.Name, a.Name)
	if _, err := a.MustSh(ctx, "sg_persist -n -o -R -T 1 -K "+keyA+" "+da); err != nil {
		return err
	}
	out, err = b.MustSh(ctx, "sg_persist -n -i -r "+db)
	if err != nil {
		return err
	}
	if !strings.Contains(out, strings.TrimPrefix(keyA, "0x")) || !strings.Contains(out, "Write Exclusive") {
		return fmt.Errorf("%s: READ RESERVATION does not show %s's Write Exclusive reservation:\n%s", b.Name, a.Name, out)
	}
	step("%s sees %s's Write Exclusive reservation", b.Name, a.Name)
	return nil
}

// smokeWrites has the holder a write and b try to: the target refuses
// b's write, and b reads a's data.
func smokeWrites(ctx context.Context, a, b *Guest, da, db string, step func(string, ...any)) error {
	if _, err := a.MustSh(ctx, "echo smoke-from-"+a.Name+" | dd of="+da+" bs=512 count=1 conv=sync,fsync oflag=direct 2>&1"); err != nil {
		return fmt.Errorf("the holder could not write: %w", err)
	}
	r, err := b.Sh(ctx, "echo smoke-from-"+b.Name+" | dd of="+db+" bs=512 count=1 conv=sync,fsync oflag=direct 2>&1")
	if err != nil {
		return err
	}
	if r.Exit == 0 {
		return fmt.Errorf("%s wrote to %s although %s holds a Write Exclusive reservation: %s", b.Name, db, a.Name, r)
	}
	step("%s's write was refused by the target: %s", b.Name, strings.TrimSpace(r.Stdout))
	out, err := b.MustSh(ctx, "dd if="+db+" bs=512 count=1 iflag=direct 2>/dev/null | head -c 32")
	if err != nil {
		return err
	}
	if !strings.HasPrefix(out, "smoke-from-"+a.Name) {
		return fmt.Errorf("%s reads %q from the LUN, want %s's data", b.Name, out, a.Name)
	}
	step("%s reads %s's data", b.Name, a.Name)
	return nil
}

// smokeRelease has a release and unregister; b must see no key left.
func smokeRelease(ctx context.Context, a, b *Guest, da, db string, step func(string, ...any)) error {
	const keyA = smokeKey
	if _, err := a.MustSh(ctx, "sg_persist -n -o -L -T 1 -K "+keyA+" "+da+" && sg_persist -n -o -G -K "+keyA+" -S 0 "+da); err != nil {
		return err
	}
	out, err := b.MustSh(ctx, "sg_persist -n -i -k "+db)
	if err != nil {
		return err
	}
	if !strings.Contains(strings.ToLower(out), "no registered reservation keys") {
		return fmt.Errorf("%s: keys remain after %s released and unregistered:\n%s", b.Name, a.Name, out)
	}
	step("%s released and unregistered; no keys remain", a.Name)
	return nil
}
