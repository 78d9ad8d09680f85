// Package cyclo counts the cyclomatic complexity of Go functions the way
// gocyclo does, so that a test can hold the repository to a complexity bar
// (no product function over 20) without a tool outside the module.
//
// A function's complexity is 1, plus 1 for each if, for and range
// statement, each case of a switch or select other than default, and each
// && and ||. Function literals count toward the function they are written
// in; a function literal assigned to a package-level variable is counted on
// its own under the variable's name.
package cyclo

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"strings"
)

// Func is one function's complexity.
type Func struct {
	// Path is the file, slash-separated and relative to the directory
	// walked.
	Path string
	// Name is the function as gocyclo names it: F, (T).M or (*T).M.
	Name       string
	Line       int
	Complexity int
}

// Key names the function across lines: "path (T).M".
func (f Func) Key() string { return f.Path + " " + f.Name }

func (f Func) String() string {
	return fmt.Sprintf("%d %s:%d %s", f.Complexity, f.Path, f.Line, f.Name)
}

// Complexity is the cyclomatic complexity of a function's node.
func Complexity(n ast.Node) int {
	c := 1
	ast.Inspect(n, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.IfStmt, *ast.ForStmt, *ast.RangeStmt:
			c++
		case *ast.CaseClause:
			if n.List != nil {
				c++
			}
		case *ast.CommClause:
			if n.Comm != nil {
				c++
			}
		case *ast.BinaryExpr:
			if n.Op == token.LAND || n.Op == token.LOR {
				c++
			}
		}
		return true
	})
	return c
}

// File counts the functions of one parsed file.
func File(fset *token.FileSet, path string, f *ast.File) []Func {
	var out []Func
	add := func(n ast.Node, name string) {
		out = append(out, Func{Path: path, Name: name, Line: fset.Position(n.Pos()).Line, Complexity: Complexity(n)})
	}
	for _, d := range f.Decls {
		switch d := d.(type) {
		case *ast.FuncDecl:
			add(d, funcName(d))
		case *ast.GenDecl:
			for _, s := range d.Specs {
				v, ok := s.(*ast.ValueSpec)
				if !ok {
					continue
				}
				for _, val := range v.Values {
					if lit, ok := val.(*ast.FuncLit); ok {
						add(lit, v.Names[0].Name)
					}
				}
			}
		}
	}
	return out
}

// Options choose the files Dir counts.
type Options struct {
	// Tests counts _test.go files too.
	Tests bool
	// Generated counts files marked "Code generated ... DO NOT EDIT." too.
	Generated bool
}

// Dir counts every function in the Go files under root, skipping testdata,
// vendor and directories whose names start with "." or "_", as go build
// and gocyclo do.
func Dir(root string, o Options) ([]Func, error) {
	var out []Func
	err := filepath.WalkDir(root, func(path string, e fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		name := e.Name()
		if e.IsDir() {
			if path != root && (name == "testdata" || name == "vendor" ||
				strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_")) {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(name, ".go") || (!o.Tests && strings.HasSuffix(name, "_test.go")) {
			return nil
		}
		fset := token.NewFileSet()
		f, err := parser.ParseFile(fset, path, nil, parser.ParseComments)
		if err != nil {
			return err
		}
		if !o.Generated && ast.IsGenerated(f) {
			return nil
		}
		rel, err := filepath.Rel(root, path)
		if err != nil {
			return err
		}
		out = append(out, File(fset, filepath.ToSlash(rel), f)...)
		return nil
	})
	return out, err
}

func funcName(d *ast.FuncDecl) string {
	if d.Recv == nil || d.Recv.NumFields() == 0 {
		return d.Name.Name
	}
	return "(" + recv(d.Recv.List[0].Type) + ")." + d.Name.Name
}

// recv names a receiver's type without its type parameters: T or *T.
func recv(t ast.Expr) string {
	switch t := t.(type) {
	case *ast.StarExpr:
		return "*" + recv(t.X)
	case *ast.IndexExpr:
		return recv(t.X)
	case *ast.IndexListExpr:
		return recv(t.X)
	case *ast.Ident:
		return t.Name
	}
	return "?"
}
